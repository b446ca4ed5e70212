"""What a user sees and hands in around a run: one-line errors, stderr, progress, stop signals,
JSON-lines files, human reports, and the checks on files and option values a user names.

The bottom layer: nothing here imports the engine, the models or the runs.
"""
