# An isolated-host runtime image, built from a ferry bundle with no network.
#
#   online host:    ferry pack spec.yaml -o out --python-version 3.11 --platform manylinux_2_28_x86_64
#   isolated host:  ferry verify out/NAME.ferry.tar && tar -xf out/NAME.ferry.tar -C out
#                   docker build --network=none --build-arg BUNDLE=out/NAME -t ferry-runtime .
#                   docker run --rm --gpus all -v $PWD/work:/work ferry-runtime train /work/config.yaml
#
# The bundle's wheels must target this image's Python (3.11) and platform. The build runs exactly the script
# that CI runs offline (docker/install-bundle.sh: install.py verifies every byte, builds the venv from the
# bundle's wheels alone with --require-hashes, places models and datasets, writes ferry.env).
FROM python:3.11-slim

ARG BUNDLE=bundle
ENV FERRY_HOME=/opt/ferry

COPY ${BUNDLE} /tmp/bundle
COPY docker/install-bundle.sh docker/entrypoint.sh /usr/local/bin/
RUN install-bundle.sh /tmp/bundle "$FERRY_HOME" && rm -rf /tmp/bundle

WORKDIR /work
ENTRYPOINT ["entrypoint.sh"]
CMD ["--help"]
