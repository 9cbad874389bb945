# Sourced first by every device script: the carried wheels (.whl/, from
# ../shared/tools/device-wheels.sh), and the checkout on the path. compile_engine/ holds links to
# the card's top-level layer folders (compile_engine/runtime -> ../runtime, ...), so the package
# imports from a plain checkout as it does installed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
