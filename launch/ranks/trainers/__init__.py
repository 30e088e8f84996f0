"""The one training loop (loop.py), the backend protocol (protocol.py) and one module per backend."""
