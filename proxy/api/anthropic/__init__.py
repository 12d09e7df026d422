"""The anthropic API under ``/<trial_id>/v1/``."""
