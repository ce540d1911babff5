# CPU image serving the bundled demo model (or a mounted checkpoint) on port 8000:
#   docker build -t jserve . && docker run -p 8000:8000 jserve
#   docker run -p 8000:8000 -v /models/llama:/model jserve serve --model /model --host 0.0.0.0
# For a GPU build pass --build-arg EXTRAS=cuda; on a TPU VM, EXTRAS=tpu.
FROM python:3.11-slim
ARG EXTRAS=""
WORKDIR /app
# g++ builds cpu_kernels on first start, for the CPU the container runs on (-march=native; cached in /cache).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY jserve ./jserve
COPY pallas_kernels ./pallas_kernels
COPY cpu_kernels ./cpu_kernels
COPY sharding ./sharding
COPY checkpoints ./checkpoints
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
# The persistent compilation cache lives in a volume so restarts skip most of the warm-up.
ENV HOME=/cache
VOLUME /cache
EXPOSE 8000
ENTRYPOINT ["jserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
