"""The responses API under ``/<trial_id>/v1/``."""
