"""The PyTriton peer of the service benchmark: its server script (server.py) and its venv (venv.py)."""
