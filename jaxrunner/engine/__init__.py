"""The offline Engine and what wraps it: lifecycle verbs for RL, request validation, multi-host lock-step."""
