"""The overseer: the supervised parent that forks, watches and replaces runners
(`overseer`)."""
