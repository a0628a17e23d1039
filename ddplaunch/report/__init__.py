"""Readers of a run's record, each rendering the one fold of its events (record/view.py): the
summary (summary.py), `status` (status.py), `top` (report/top.py) and the run page (page.py).
"""
