"""A run as data: its typed events (record/events.py, the run's one memory), the fold every reader
shares (view.py), its identity and where its supervisor runs (record/runs.py), and what a stage left
behind (record/results.py). No backend is imported here.
"""
