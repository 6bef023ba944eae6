"""Periodic tasks get ``anchor``: what an ``every SPAN`` timer counts its next due time from
— ``due``, the due time just handled (a fixed grid: the default, and what every existing row
keeps), or ``now``, the moment the scheduler handled it (Nuntium's ``nextRun = currentTime +
interval``: a scheduler running late moves the following due times with it).

Nuntium's timebox becomes the default of Nuntium's mode: an existing periodic task with a
``tolerance`` and neither a timebox nor a max_runtime gets the one a new definition gets,
``timebox = 'half'``, max_runtime = interval / 2 — its interval being min_spacing + tolerance
(definitions.py derived min_spacing = interval - tolerance). Tasks already submitted keep the
max_runtime they were submitted with."""


def up(migrator, db):
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN anchor VARCHAR(8) NOT NULL "
                   "DEFAULT 'due'")
    db.execute_sql("UPDATE periodic_tasks SET timebox = 'half', "
                   "max_runtime = (min_spacing + tolerance) / 2 "
                   "WHERE tolerance IS NOT NULL AND min_spacing IS NOT NULL "
                   "AND timebox IS NULL AND max_runtime IS NULL")
