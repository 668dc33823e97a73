"""gradsync: one model, every synchronization architecture, verified and measured side by side."""

__version__ = "0.1.0"
