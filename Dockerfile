# The outbox-relay image: `outbox-relay` (migrate, status, metrics ...) and
# `celery -A outbox_relay.app worker|beat`, configured from the environment
# (see .env.example and docs/configuration.md). docker-compose.yml runs it.
#
#   docker build -t outbox-relay .                 # the relay
#   docker build -t outbox-relay-flower --target flower .

FROM python:3.11-slim AS relay

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# README.m[d]: the README when present (package metadata); the build does not need it.
COPY pyproject.toml README.m[d] ./
COPY outbox_relay ./outbox_relay
RUN pip install . \
    && rm -rf /src/* \
    && useradd --system --uid 10001 --home-dir /home/relay --create-home relay \
    # Worker metric files for Prometheus (PROMETHEUS_MULTIPROC_DIR), and beat's
    # schedule file (when each entry last ran); compose mounts a volume on each.
    && mkdir -p /run/outbox-relay/metrics /var/lib/outbox-relay/beat \
    && chown relay /run/outbox-relay/metrics /var/lib/outbox-relay/beat

# A working directory of the relay's own: app.py imports a `celeryconfig`
# module from here when one exists (mount one to configure Celery itself).
WORKDIR /home/relay
USER relay
CMD ["outbox-relay", "--help"]


# Flower (the Celery monitor) with the relay's task names; kept out of the relay image.
FROM relay AS flower
USER root
RUN pip install "flower>=2.0"
USER relay
EXPOSE 5555
CMD ["celery", "-A", "outbox_relay.app", "flower", "--port=5555"]
