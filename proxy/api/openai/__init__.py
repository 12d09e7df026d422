"""The OpenAI-compatible API under ``/<trial_id>/v1/``."""
