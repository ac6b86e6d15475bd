"""Replica handles and launchers."""
