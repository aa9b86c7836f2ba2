"""Fault injection for chaos runs: seeded or scripted schedules, an injector, a TCP proxy."""
