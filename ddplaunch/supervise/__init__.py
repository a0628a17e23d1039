"""Where a run's loop runs and how it is followed: the daemon on this machine (daemon.py), the
hand-over to another process (plan/handoff.py) or host (supervise/remote.py), following a run (follow.py) and
the commands on a recorded run (commands.py: status, logs, down).
"""
