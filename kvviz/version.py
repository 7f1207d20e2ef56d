"""kvviz's version, in a module of its own so any layer can name it without importing the rest."""

__version__ = "0.1.0"
