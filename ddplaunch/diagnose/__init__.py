"""Which host, and why: the pre-flight (diagnose/preflight.py), bad-host localization (diagnose/localize.py),
broken training links (links.py), the kernel's OOM killer (oom.py), where hung ranks are stuck
(stacks.py) and stragglers (diagnose/stragglers.py). Each judge is pure, apart from the probe that feeds it.
"""
