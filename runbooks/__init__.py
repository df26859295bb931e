"""Scripts that run on the instance (copied there by the daemon) and their helpers; stdlib-only."""
