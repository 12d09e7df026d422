"""The Anthropic Messages API under ``/<trial_id>/v1/``."""
