# The Conductor image used by compose.yaml: every Conductor process (worker, router, bridge, engine).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY state ./state
COPY streams ./streams
COPY conductor ./conductor
RUN pip install --no-cache-dir .
# Unprivileged; the embedded stack is never used in containers (Kafka and Redis are services).
RUN useradd --create-home conductor
USER conductor
# Writable: the worker keeps its local table state under the working directory.
WORKDIR /home/conductor
ENTRYPOINT ["conductor"]
