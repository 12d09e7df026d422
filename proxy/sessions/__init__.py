"""Trial sessions: the tree of contexts each trial's requests build, and their export."""
