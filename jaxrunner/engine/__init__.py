"""The offline Engine and what wraps it: its contract with the server (base.py), the answers it
gives (output.py), lifecycle verbs for RL, request validation, multi-host lock-step."""
