# Sourced by the device scripts: puts the CuTe DSL bundle (and, with PEER=1, FA4's peer bundle) on PYTHONPATH.
# A call that carries .dev/cute unpacks it through its setup.sh; a later call on the same warm machine may
# carry only .dev/peer (the tree, the cute bundle and the peer bundle together pass the 64 MiB a call
# carries) and then finds the bundle already unpacked in /tmp/cute-site by the earlier call.
if [ -f .dev/cute/setup.sh ]; then
  source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; return 1; }
elif [ -f /tmp/cute-site/.ok ]; then
  export PYTHONPATH="/tmp/cute-site:/tmp/cute-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no CuTe DSL: carry .dev/cute, or run on a machine an earlier call unpacked it on"; return 1
fi
if [ "${PEER:-0}" = 1 ]; then
  if [ -f .dev/peer/peer-site.tar.xz ]; then
    mkdir -p /tmp/peersite && tar xJf .dev/peer/peer-site.tar.xz -C /tmp/peersite
    # fa4peer imports jaxtyping (annotations only), which the peer bundle leaves out; where the machine
    # lacks it, .dev/peer/peer-deps.tar.xz (jaxtyping and wadler_lindig, pure Python) supplies it.
    python3 -c "import jaxtyping" 2>/dev/null || { [ -f .dev/peer/peer-deps.tar.xz ] && tar xJf .dev/peer/peer-deps.tar.xz -C /tmp/peersite; }
  fi
  [ -d /tmp/peersite/fa4peer ] || { echo "no peer bundle: carry .dev/peer"; return 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/peersite"
fi
