"""Developer tools that are not part of the package: the sm100 compile-and-report inspection and the
kernel binary comparison. Run from the repository root (the tests put it on sys.path)."""
