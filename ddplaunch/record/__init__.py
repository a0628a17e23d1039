"""A run as data: its typed events (events.py, the run's one memory), the fold every reader
shares (view.py), its identity and where its supervisor runs (runs.py), and what a stage left
behind (results.py). No backend is imported here.
"""
