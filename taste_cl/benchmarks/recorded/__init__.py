"""Benchmarks on data people recorded: the UEA/UCR sets bundled in aeon's wheel (``real``) and scikit-learn's
handwritten digits under corruptions (``adapt``)."""
