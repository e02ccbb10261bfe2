"""Hyrax: serving hybrid language models on Ray."""
__version__ = "0.1.0"
