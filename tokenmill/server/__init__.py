"""The composition root: what a start wires together (models loaded, engines built around them, the app served).

It imports api/, engine/, model/ and the rest; none of those imports it (tests/test_layering.py). Nothing is imported
here, so that start.py can begin hashing the models' files before torch is imported.
"""
