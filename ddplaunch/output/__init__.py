"""What the ranks print, read into data and shown to people.

`[host:rank]` prefixes (who.py), torchrun's and PyTorch's text (torchrun.py), one launch's lines
read as they come (output/stagelines.py) and the console that shows them (output/console.py).
"""
