"""Compatibility layers for code written against other libraries' APIs."""
