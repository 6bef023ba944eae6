"""Integrations with application frameworks, each an optional extra: nothing outside this
package imports them, so ``import taskrunner`` and the runner load no framework."""
