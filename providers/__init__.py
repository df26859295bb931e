"""Cloud provider adapters behind one interface (see providers.base)."""
