"""Older session-store layouts, made from a current store file, for the migration tests:
each function takes the layout back one step (the schema version it names)."""

from __future__ import annotations

import sqlite3


def drop_teacher(db: sqlite3.Connection) -> None:
    """Back to version 6: turns without a teacher's logprobs."""
    db.execute("ALTER TABLE turns DROP COLUMN teacher_model")
    db.execute("ALTER TABLE turns DROP COLUMN teacher_logprobs")


def drop_server_errors(db: sqlite3.Connection) -> None:
    """Back to version 5: sessions without their count of server errors."""
    drop_teacher(db)
    db.execute("ALTER TABLE sessions DROP COLUMN server_errors")


def drop_agents(db: sqlite3.Connection) -> None:
    """Back to version 4: no turn's agent, no trial's outcome or agents' rewards."""
    drop_server_errors(db)
    db.execute("ALTER TABLE turns DROP COLUMN agent")
    db.execute("ALTER TABLE sessions DROP COLUMN outcome")
    db.execute("ALTER TABLE sessions DROP COLUMN agent_rewards")


def drop_routing(db: sqlite3.Connection) -> None:
    """Back to version 3: turns without routing rows."""
    db.execute("ALTER TABLE turns DROP COLUMN routing")
    db.execute("ALTER TABLE turns DROP COLUMN routing_head")
