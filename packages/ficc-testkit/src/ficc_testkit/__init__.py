"""Shared test machinery of the ficc monorepo (never released)."""
