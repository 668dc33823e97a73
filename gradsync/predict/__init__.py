"""``gradsync profile`` and ``gradsync predict``: every strategy projected to N machines and
any network from one measured single-worker profile (a discrete-event simulation of the
strategies' real policies), and checked against emulated hosts."""
