# Sourced first by every device script: the carried wheels (.whl/, from
# ../shared/tools/device-wheels.sh) and the package as an install lays it out, without installing.
# pyproject.toml maps the card's top-level folders to subpackages of compile_engine; the GPU
# machine has no network for a build backend, so links in /tmp/ce/compile_engine stand for the
# install (Path(__file__).resolve() still finds the checkout, as the passes' uuids need).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
mkdir -p /tmp/ce/compile_engine
for f in compile_engine/*.py; do ln -sfn "$PWD/$f" /tmp/ce/compile_engine/; done
for d in benchmarks compiler kernels_generated models passes runtime; do
  ln -sfn "$PWD/$d" "/tmp/ce/compile_engine/$d"
done
export PYTHONPATH=/tmp/ce:/tmp/site
