"""PURE: spec -> what runs where.

Each stage's launch plan (run/launch.py: torchrun's arguments, environment and setup per node), which
stages a command makes and on which hosts (stages.py), the container runtime's words in front of
torchrun (plan/container.py), quoting for a shell (plan/shellword.py, plan/hostwords.py) and the host programs
with their nonce-marked answers (hostprogram.py). Nothing runs here.
"""
