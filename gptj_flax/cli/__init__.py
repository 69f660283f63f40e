"""The command-line programs (``gptj-train``, ``gptj-sample``, …): the top layer, importing from all others.

Each module's ``main()`` parses ``sys.argv`` and returns the exit status; ``scripts/*.py`` call the same.
"""
