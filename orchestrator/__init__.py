"""burstctl: decide, job by job, whether ML training runs on the local GPU or bursts to a rented one."""

__version__ = "0.1.0"
