"""WHAT runs: the validated cluster spec and reading it.

The models and value types (model.py, values.py), reading a file into one with file:line errors
(load.py over the bounded YAML loader spec/yamlsafe.py and spec/yamlnodes.py), Slurm hostlists and
hostfiles, the backends' registrations (spec/registry.py), the shipped example jobs and the specs
`ddplaunch init` writes (templates.py). Data and validation only: nothing runs here.
"""
