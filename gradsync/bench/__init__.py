"""``gradsync bench``: experiment files → a sweep of jobs → statistics → a report."""
