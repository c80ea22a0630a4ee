//! The loop's side of the relay between a multi-node job's daemons (docs/fanout.md):
//! the jobs whose prolog prefetch ran here with a node list, which nodes they have and
//! which files their profile names (what other nodes may fetch from here, and nothing
//! else), and this node's parent in the job's tree, which its copies come from first
//! and which vouches for its job starts' checks.
//! `Relays` owns that state; the loop asks the keeper whether a copy is held.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    cache::relay::Parent,
    control::{
        messages::{Answer, JobNodes},
        refusal::Refusal,
        relay::NOT_KNOWN_YET,
    },
    profile::format::Profile,
    shared::{relay, settings::Settings},
};

/// Jobs served to other nodes at once: the oldest is forgotten first.
const MAX_RELAYED: usize = 64;
/// How long a job's files are served after its prolog.
const SERVED_FOR: Duration = Duration::from_secs(3600);
/// How long a job's prolog may take to read its profile before the job's files are
/// asked for here: past it, none are served.
const READ_WITHIN: Duration = Duration::from_secs(60);
/// How long the parent's name may take to resolve.
const RESOLVE: Duration = Duration::from_secs(2);

struct Relayed {
    job_id: u32,
    me: String,
    nodes: HashSet<String>,
    /// None until its prolog here has read its profile.
    files: Option<HashSet<String>>,
    since: Instant,
    /// This node's parent in the job's tree: its copies come from there first, and it
    /// vouches for this node's job-start checks.
    parent: Option<Arc<Parent>>,
}

#[derive(Default)]
pub struct Relays {
    jobs: Vec<Relayed>,
}

impl Relays {
    /// A job's prolog with `nodes` began: its nodes may ask this node for it, and once
    /// its `profile` is read, fetch that profile's files from here. The parent node this
    /// node copies from first, if any (the same for the job's prolog, once found).
    pub async fn add(
        &mut self,
        nodes: &JobNodes,
        profile: Option<&Profile>,
        settings: &Settings,
    ) -> Option<Arc<Parent>> {
        let port = settings.relay_port()?;
        let me = nodes.nodes.iter().position(|n| *n == nodes.me)?;
        let files = profile.map(|p| p.files.iter().map(|f| f.path.clone()).collect());
        if let Some(job) = self
            .jobs
            .iter_mut()
            .find(|r| r.job_id == nodes.job_id && r.since.elapsed() < SERVED_FOR)
        {
            if files.is_some() {
                job.files = files;
            }
            return job.parent.clone();
        }
        let relays = &mut self.jobs;
        relays.retain(|r| r.job_id != nodes.job_id && r.since.elapsed() < SERVED_FOR);
        if relays.len() >= MAX_RELAYED {
            relays.remove(0);
        }
        relays.push(Relayed {
            job_id: nodes.job_id,
            me: nodes.me.clone(),
            nodes: nodes.nodes.iter().cloned().collect(),
            files,
            since: Instant::now(),
            parent: None,
        });
        let parent = &nodes.nodes[relay::parent(me, settings.fanout_width())?];
        let addr = match resolve(parent, port).await {
            Ok(a) => a,
            Err(e) => {
                log::warn!(
                    "Slurm job {}: cannot find node {parent}'s address ({e}): this node reads the job's files from the network",
                    nodes.job_id
                );
                return None;
            }
        };
        log::info!(
            "Slurm job {}: node {} fetches its files from node {parent} ({addr}) first",
            nodes.job_id,
            nodes.me
        );
        let parent = Arc::new(Parent::new(
            parent.clone(),
            addr,
            relay::payload(nodes.job_id, &nodes.me, parent),
            settings.munge_socket.clone(),
            settings.relay_timeout(),
        ));
        if let Some(job) = relays.last_mut() {
            job.parent = Some(parent.clone());
        }
        Some(parent)
    }

    /// Slurm job `job_id`'s prolog failed here: its nodes may not ask for it.
    pub fn forget(&mut self, job_id: u32) {
        self.jobs.retain(|r| r.job_id != job_id);
    }

    /// This node's parent in Slurm job `job_id`'s tree, if it has one.
    pub fn parent_of(&self, job_id: u32) -> Option<Arc<Parent>> {
        self.relayed(job_id)?.parent.clone()
    }

    /// Whether node `from` may ask this node to vouch for its starts of `job_id`.
    pub fn may_vouch(&self, job_id: u32, from: &str) -> Result<(), Refusal> {
        match self.relayed(job_id) {
            Some(job) if job.nodes.contains(from) && from != job.me => Ok(()),
            _ => Err(Refusal::new(
                "relay_refused",
                format!("node {from} may not ask for Slurm job {job_id}'s checks"),
            )),
        }
    }

    /// Node `from` asks to fetch `job_id`'s files from this node, which it calls `to`.
    pub fn join(&self, job_id: u32, from: &str, to: &str) -> Answer {
        let Some(job) = self.relayed(job_id) else {
            return Refusal::new(
                NOT_KNOWN_YET,
                format!("Slurm job {job_id} is not known here (no prolog of it ran on this node)"),
            )
            .into();
        };
        let refuse = |message: String| Refusal::new("relay_refused", message).into();
        if to != job.me {
            refuse(format!(
                "the credential is for node {to}; this is node {}",
                job.me
            ))
        } else if from == job.me || !job.nodes.contains(from) {
            refuse(format!("node {from} is not one of Slurm job {job_id}'s"))
        } else {
            Answer::Ready
        }
    }

    /// Whether node `from` of the job may fetch `source` from here: refused, or whether
    /// the job's profile names it (only then is the keeper asked for its copy); None
    /// while its prolog here has not read it yet.
    pub fn may_fetch(
        &self,
        job_id: u32,
        from: &str,
        source: &str,
    ) -> Result<Option<bool>, Refusal> {
        let Some(job) = self.relayed(job_id).filter(|j| j.nodes.contains(from)) else {
            return Err(Refusal::new(
                "relay_refused",
                format!("node {from} may not fetch Slurm job {job_id}'s files"),
            ));
        };
        match &job.files {
            Some(files) => Ok(Some(files.contains(source))),
            // A prolog that never told what it read serves nothing.
            None if job.since.elapsed() > READ_WITHIN => Ok(Some(false)),
            None => Ok(None),
        }
    }

    fn relayed(&self, job_id: u32) -> Option<&Relayed> {
        self.jobs
            .iter()
            .find(|r| r.job_id == job_id && r.since.elapsed() < SERVED_FOR)
    }
}

/// `node`'s address: its name through the resolver (/etc/hosts, DNS), as Slurm's
/// `NodeAddr` usually is.
async fn resolve(node: &str, port: u16) -> std::io::Result<SocketAddr> {
    let found = tokio::time::timeout(RESOLVE, tokio::net::lookup_host((node, port)))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    let mut found: Vec<SocketAddr> = found.collect();
    // IPv4 first: the relay listens on every IPv4 address.
    found.sort_by_key(|a| !a.is_ipv4());
    found
        .into_iter()
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))
}
