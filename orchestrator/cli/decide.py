"""`burstctl decide`."""
