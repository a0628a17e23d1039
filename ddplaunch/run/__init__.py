"""The one run loop: a run's stages, their gates, the hang watch, recovery, eviction and spares.

`run/begin.py` begins a run (its record and event log) and runs its loop (`loop.py`) in this
process; `gates.py` decides after the pre-flight and the health check, `hangwatch.py` watches
the job, `run/recovery.py`, `eviction.py` and `spares.py` heal what fails.
"""
