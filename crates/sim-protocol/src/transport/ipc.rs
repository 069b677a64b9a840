//! A [`FrontendListener`] whose data sockets are `ipc://` (Unix-domain) sockets, as a
//! Python frontend binds them for an engine on its own host, with the handshake on TCP.

use std::path::Path;

use super::{FrontendListener, TransportError, bind_pull, bind_router};

impl FrontendListener {
    /// Bind the handshake ROUTER at `handshake_address` (a `tcp://` address) and the data
    /// sockets as `ipc://` sockets in `dir` (`in-C` and `out-C` for client `C`), which must
    /// exist; the caller removes the socket files.
    pub async fn bind_ipc_data(
        handshake_address: &str,
        dir: &Path,
        clients: usize,
    ) -> Result<Self, TransportError> {
        let mut fl = Self::bind_at(handshake_address, 0).await?;
        fl.inputs.clear();
        fl.input_addresses.clear();
        fl.outputs.clear();
        fl.output_addresses.clear();
        for c in 0..clients.max(1) {
            let at = |what: &str| format!("ipc://{}", dir.join(format!("{what}-{c}")).display());
            let (r, a) = bind_router(&at("in")).await?;
            fl.inputs.push(r);
            fl.input_addresses.push(a);
            let (p, a) = bind_pull(&at("out")).await?;
            fl.outputs.push(p);
            fl.output_addresses.push(a);
        }
        Ok(fl)
    }
}
