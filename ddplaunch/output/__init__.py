"""What the ranks print, read into data and shown to people.

A node's line read once into a typed line, and the `[host:rank]` prefix read and rendered
(who.py); torchrun's and PyTorch's text (torchrun.py); one launch's lines read as they come
(output/stagelines.py) and the console that shows them (output/console.py).
"""
