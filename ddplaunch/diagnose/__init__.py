"""Which host, and why: the pre-flight (preflight.py), bad-host localization (localize.py),
broken training links (links.py), the kernel's OOM killer (oom.py), where hung ranks are stuck
(stacks.py) and stragglers (stragglers.py). Each judge is pure, apart from the probe that feeds it.
"""
