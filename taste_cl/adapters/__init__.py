"""Integrations with other frameworks, shipped as ``taste_cl.adapters``.

Each adapter imports its heavy dependency lazily and raises
:class:`~taste_cl.exceptions.MissingDependencyError` naming the extra to install.
"""
