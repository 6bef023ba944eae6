"""No Django models: taskrunner's tables are its own (created by its migrations). The module
exists because Django sends ``post_migrate`` only to apps that have one (apps.py)."""
