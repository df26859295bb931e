"""The pure decision core: gates, sizing, market choice, budget, spot policy. No I/O lives here."""
