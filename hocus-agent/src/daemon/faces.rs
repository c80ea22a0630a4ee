//! The daemon's faces, started once it is set up: the control socket (and its
//! connections' shared settings) and the relay port; their requests come to the loop
//! as calls.

use anyhow::Result;
use tokio::sync::mpsc;

use super::Daemon;
use crate::control::{
    calls,
    gate::Limits,
    messages::{Answer, Ask, Call},
    refusal::Refusal,
    relay, server,
};

impl Daemon {
    /// Serves the control socket and the relay port; their requests come in as calls.
    pub(super) fn serve(&mut self, calls: mpsc::Sender<Call>) -> Result<()> {
        let settings = &self.opts.settings;
        let limits = Limits {
            total: settings.max_clients.unwrap_or(256),
            per_user: settings.max_clients_per_user.unwrap_or(16),
        };
        let setup = calls::Setup {
            trees: self.watched.iter().map(|w| w.path.clone()).collect(),
            job_profiles: settings.job_profiles(),
            bind_opens: self.jobs.bind_opens(),
            max_profile_entries: settings.max_profile_entries(),
            max_user_profile_entries: settings.max_user_profile_entries(),
            fanout_width: settings.fanout_width(),
        };
        if let Some(port) = settings.relay_port() {
            let serving = relay::Serving {
                port,
                munge_socket: settings.munge_socket.clone(),
                timeout: settings.relay_timeout(),
            };
            match relay::serve(serving, calls.clone()) {
                Ok(addr) => log::info!(
                    "relay: the nodes of multi-node Slurm jobs, and later jobs of a profile saved here, fetch their files from each other through {addr}"
                ),
                // Any user may listen there first: what answers is not this daemon, and
                // the children's check of its proof turns them to the server.
                Err(e) => log::error!(
                    "relay: cannot listen on port {port} ({e}): if another program holds it (any user may listen there), this node's children in multi-node jobs refuse it and read their files from the server; free the port (ss -ltnp 'sport = :{port}') and restart hocus-agent, or set relay-port"
                ),
            }
        }
        self.control = Some(server::serve(&self.socket, calls, limits, setup)?);
        log::info!(
            "ready: profile in {}, control socket {}{}",
            self.profiling.profile_path().display(),
            self.socket.display(),
            self.metrics_addr
                .map(|a| format!(", metrics on http://{a}/metrics"))
                .unwrap_or_default()
        );
        Ok(())
    }
}

impl Daemon {
    /// Answers a job session's `Binds` (the binds its namespace gets) or a child node's
    /// `RelayVouch` (the binds this node would check for a start of its own).
    pub(super) async fn give_binds(&mut self, ask: Ask, reply: mpsc::UnboundedSender<Answer>) {
        match ask {
            Ask::RelayVouch { job_id, from } => {
                if let Err(r) = self.relays.may_vouch(job_id, &from) {
                    let _ = reply.send(r.into());
                    return;
                }
            }
            // The first step of every job session, before its namespace is made: the
            // tracer follows the job from its start.
            Ask::Binds => self.wake_for_job().await,
            _ => {}
        }
        // Answered off the loop: a keeper busy placing a million entries holds up this
        // job, not the loop.
        let keeper = self.keeper.clone();
        tokio::spawn(async move {
            let answer = match keeper.binds().await {
                Ok(binds) => Answer::Binds(binds),
                Err(e) => Refusal::new("busy", e.to_string()).into(),
            };
            reply.send(answer)
        });
    }
}
