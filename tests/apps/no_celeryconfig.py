"""An empty Celery configuration: the relay processes of the tests take
every setting from their environment, not from the example celeryconfig.py."""
