"""WHAT runs: the validated cluster spec and reading it.

The models and value types (model.py, values.py), reading a file into one with file:line errors
(load.py over the bounded YAML loader yamlsafe.py and yamlnodes.py), Slurm hostlists and
hostfiles, the backends' registrations (registry.py), the shipped example jobs and the specs
`ddplaunch init` writes (templates.py). Data and validation only: nothing runs here.
"""
