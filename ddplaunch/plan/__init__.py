"""PURE: spec -> what runs where.

Each stage's launch plan (launch.py: `make_plan(PlanContext, Stage, port, StageOptions)`, torchrun's
arguments, environment and setup per node), which stages a command makes and on which hosts
(stages.py), the container runtime's words in front of torchrun and the image check
(container.py), emulated ranks (emulation.py), quoting for a shell (shellword.py, hostwords.py)
and the host programs with their nonce-marked answers (hostprogram.py). Nothing runs here.
"""
